"""The authenticated link between two Strata processes: handshake, control messages, tensors."""
