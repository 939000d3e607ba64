"""Placement: which queued job goes to which connected worker, fairly and within quotas."""
