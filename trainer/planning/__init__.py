"""Planning: fingerprint, plans (nnU-Net 2.8.1's rules, nnui's CPU plans, the ResEnc presets),
splits, preprocessing."""
