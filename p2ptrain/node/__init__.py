"""A whole peer: `peer.Peer` builds one from the run's recipe and `options.NodeOptions`, and `metrics` publishes
its progress. Import `p2ptrain.Peer`; this package's own import stays light so command lines parse fast."""
