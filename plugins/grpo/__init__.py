"""GRPO: Group Relative Policy Optimization (DeepSeekMath; TRL's GRPOTrainer)."""
