"""Layer 5, integrations: pagedkv inside other libraries. ``pagedkv.integrations.hf`` plugs the
paged cache and the paged attention into Hugging Face transformers (imported only there; the
rest of the package never imports transformers)."""
