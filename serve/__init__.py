"""baton.serve"""
