"""The checked-in gRPC stubs are what protoc generates from protos/ today."""

from splitspec import protogen
from splitspec.api.v1 import splitspec_pb2 as pb


def test_stubs_in_sync_with_proto():
    assert protogen.out_of_sync() == []


def test_fixed_names():
    """Names clients rely on (issue 3) exist with the documented shape."""
    service = pb.DESCRIPTOR.services_by_name["SpecDecode"]
    assert [m.name for m in service.methods] == ["Generate", "GenerateStream"]
    assert pb.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
    assert pb.SpeculationPolicy.Mode.Name(0) == "MODE_UNSPECIFIED"
    request = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    for name in ("request_id", "prompt", "messages", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "speculation"):
        assert name in request
    assert request["top_p"].has_presence and request["seed"].has_presence and request["max_new_tokens"].has_presence
    for name in ("request_id", "text", "token_ids", "finish_reason", "usage", "speculation_stats"):
        assert name in pb.GenerateResponse.DESCRIPTOR.fields_by_name
    for name in ("request_id", "text", "token_ids", "accepted_tokens", "finish_reason"):
        assert name in pb.GenerateStreamResponse.DESCRIPTOR.fields_by_name
