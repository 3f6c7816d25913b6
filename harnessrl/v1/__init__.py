"""Generated protobuf and gRPC code for package harnessrl.v1 (see protos/; do not edit)."""
