"""Data: prompt formatting, instruction datasets, the SAR-SFT collator."""
