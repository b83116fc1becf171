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


def test_logprob_fields_are_additive():
    """Logprobs (issue 41) came as new fields only: a request's switch and count, per-token entries in responses."""
    for request in (pb.GenerateRequest, pb.GenerateStreamRequest):
        fields = request.DESCRIPTOR.fields_by_name
        assert (fields["logprobs"].number, fields["top_logprobs"].number) == (11, 12)
    assert pb.GenerateResponse.DESCRIPTOR.fields_by_name["logprobs"].number == 8
    assert pb.GenerateStreamResponse.DESCRIPTOR.fields_by_name["logprobs"].number == 10
    entry = pb.TokenLogprob(token_id=5, logprob=-0.25, top_logprobs=[pb.TopLogprob(token_id=5, logprob=-0.25)])
    assert pb.TokenLogprob.FromString(entry.SerializeToString()) == entry
