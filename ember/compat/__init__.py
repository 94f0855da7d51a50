"""Facades of other engines' Python APIs over ember's native engine: their users' scripts run with only the import
lines changed. Each facade translates names and shapes; every request goes through ember.frontend.EngineClient."""
