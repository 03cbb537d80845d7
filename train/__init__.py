"""baton.train"""
