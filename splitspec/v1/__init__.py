"""Generated gRPC stubs of protos/splitspec/v1 (do not edit; see splitspec.protogen)."""
