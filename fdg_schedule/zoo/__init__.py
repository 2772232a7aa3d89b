"""Model zoo for the recipes: models as DeepSpeed pipeline layer lists, and data sets that load offline."""
