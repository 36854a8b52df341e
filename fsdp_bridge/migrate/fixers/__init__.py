"""One module per FSDP1 construct family the scanner (:mod:`fsdp_bridge.migrate._scanner`) is made of."""
