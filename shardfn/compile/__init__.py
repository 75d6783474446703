"""torch.compile (dynamo) integration."""
