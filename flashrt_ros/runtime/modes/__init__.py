"""One driver per mode (language model, robot policy, speech): what the facade delegates to."""
