"""Every table, imported in one place so `Base.metadata` is complete for migrations and schema checks."""

from loraplex.platform.db.base import Base
from loraplex.platform.domain.api_keys.models import AdminKey, ApiKey
from loraplex.platform.domain.tenants.models import Tenant

__all__ = ["AdminKey", "ApiKey", "Base", "Tenant"]
