"""dtrain's subcommands that do not train: `doctor` and `report`."""
