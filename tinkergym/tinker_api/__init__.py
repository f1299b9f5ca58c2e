"""The Tinker API served by tinkergym: the SDK's protobuf wire (:mod:`.wire`), its built-in losses and the service."""
