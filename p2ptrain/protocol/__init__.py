"""Pure protocol logic: row segmentation, the ledger and the task pool. No sockets, no clocks."""
