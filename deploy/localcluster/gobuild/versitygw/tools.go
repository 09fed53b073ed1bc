//go:build tools

// Pins versitygw, the S3-compatible gateway (posix backend) the snapshot store's S3
// implementation is tested against on loopback.
package tools

import _ "github.com/versity/versitygw/cmd/versitygw"
