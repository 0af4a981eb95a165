"""The package version: one definition, read by the package, `via-edge --version` and the build."""

VERSION = "0.1.0"
