"""Live planning (issue 3): peers measure and announce their compute and links, a planner turns what the DHT
holds into a plan and publishes it signed, and peers started without --stage adopt their place from it."""
