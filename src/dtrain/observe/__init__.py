"""What a run reports about itself (console, TensorBoard, trackers, step times, memory, hangs,
profiles). Nothing here changes training."""
