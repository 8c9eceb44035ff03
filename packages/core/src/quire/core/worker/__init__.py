"""Model execution: the persistent input batch, input preparation, sampling and KV memory."""
