"""The runtime's stage servers: frontal (FS) and backward (BS) servers, their state, and the data source."""
