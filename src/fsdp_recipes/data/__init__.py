"""The data room: formats (each one entry: detection, conversion, checks), loading, splits, lengths, preview."""
