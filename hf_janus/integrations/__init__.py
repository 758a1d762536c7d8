"""integrations"""
