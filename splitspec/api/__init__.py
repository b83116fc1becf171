"""The API package, shared by the server and its clients: the generated gRPC stubs of protos/splitspec/api/v1
(``v1``), the Python client (``client``) and the bearer token's names (``auth``). It imports nothing of the server
(``deployments``, ``services``)."""
