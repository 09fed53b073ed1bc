//go:build tools

// Pins the reference OCI registry (CNCF distribution) for the local cluster.
package tools

import _ "github.com/distribution/distribution/v3/cmd/registry"
