"""The networks (plain and residual-encoder U-Nets), their norm, losses and compute precision."""
