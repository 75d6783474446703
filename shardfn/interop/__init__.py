"""Interoperation with torch.distributed.tensor (DTensor)."""
