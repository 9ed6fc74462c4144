"""SAR-SFT training: loss, Trainer subclass, run entry point."""
