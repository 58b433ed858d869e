"""LoRA adapters: PEFT folders read and checked, device slots, the registry (engine/lora/)."""
