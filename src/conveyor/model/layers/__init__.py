"""Building blocks of the Llama-family model: RMSNorm, rotary embedding, paged attention."""
