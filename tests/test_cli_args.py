"""Every subcommand that starts a local service (splitspec.cli._service) parses to the arguments it reads: the soak
once lacked the HTTP port and failed after its models loaded."""

import pytest

from splitspec.cli import build_parser

SERVICE_ARGS = ("address", "nodes", "config", "grpc_port", "http_port")


@pytest.mark.parametrize("command", [["soak"], ["bench", "grpc"], ["bench", "load"]])
def test_service_commands_carry_what_the_service_needs(command):
    args = build_parser().parse_args(command)
    missing = [name for name in SERVICE_ARGS if not hasattr(args, name)]
    assert not missing, missing
