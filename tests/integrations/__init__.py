"""Tests of kvflow/integrations/."""
