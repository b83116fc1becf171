"""Generated gRPC stubs of protos/splitspec/api/v1 (do not edit; see splitspec.protogen)."""
