"""Every table, imported in one place so `Base.metadata` is complete for migrations and schema checks."""

from loraplex.platform.db.base import Base
from loraplex.platform.domain.adapters.models import Adapter
from loraplex.platform.domain.api_keys.models import AdminKey, ApiKey
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.billing.models import PriceVersion
from loraplex.platform.domain.endpoints.models import Endpoint
from loraplex.platform.domain.responses.models import StoredResponse
from loraplex.platform.domain.tenants.models import Tenant
from loraplex.platform.domain.usage.models import UsageRecord
from loraplex.platform.jobs.models import Job

__all__ = [
    "Adapter",
    "AdminKey",
    "ApiKey",
    "Base",
    "BaseModel",
    "Endpoint",
    "Job",
    "PriceVersion",
    "StoredResponse",
    "Tenant",
    "UsageRecord",
]
