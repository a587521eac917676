"""Pure protocol logic: row segmentation, layouts, the ledger, the task pool, epoch closure and the typed
messages peers exchange. No sockets, no clocks, no torch."""
