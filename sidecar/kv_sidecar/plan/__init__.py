"""The plan: which bytes go where. Pure functions of two engine descriptions."""
