"""Losses over sparse reps: contrastive (InfoNCE, MarginMSE), regularizers (FLOPS, L1) and the SPLADE loss."""

__all__: list[str] = []
