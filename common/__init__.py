"""baton.common"""
