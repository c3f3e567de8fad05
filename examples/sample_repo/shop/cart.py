"""A shopping cart with per-item quantities and a percentage discount."""

from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1


@dataclass
class Cart:
    items: list[Item] = field(default_factory=list)

    def add(self, name: str, price: float, quantity: int = 1) -> None:
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        self.items.append(Item(name, price, quantity))

    def subtotal(self) -> float:
        return sum(item.price for item in self.items)

    def total(self, discount_percent: float = 0.0) -> float:
        return round(self.subtotal() * (1 - discount_percent / 100), 2)
