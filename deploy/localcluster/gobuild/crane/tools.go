//go:build tools

// Pins crane (go-containerregistry), which pushes the local image tarballs.
package tools

import _ "github.com/google/go-containerregistry/cmd/crane"
