"""The ownership ledger: SQLAlchemy models and the state machine around them."""
