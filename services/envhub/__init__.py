"""envhub"""
