"""Billing: a versioned price book per base model, and cost reports rated from the usage rows."""
