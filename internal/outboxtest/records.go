package outboxtest

import (
	"database/sql"
	"testing"
	"time"

	"gorm.io/gorm"
)

// Record is one row of the outbox table, as the tests read it.
type Record struct {
	ID                int64
	EventID           string
	EventType         string
	AggregateType     string
	AggregateID       string
	AggregateSequence int64
	IdempotencyKey    string
	Payload           string
	Headers           sql.NullString
	DeliveryState     string
	DeliveryAttempts  int
	NextAttemptAt     time.Time
	BatchID           sql.NullString
	LastError         sql.NullString
	LockedUntil       sql.NullTime
	OccurredAt        time.Time
	CreatedAt         time.Time
	UpdatedAt         time.Time
	DeliveredAt       sql.NullTime
}

// Records returns every row of table in id order.
func Records(t testing.TB, db *gorm.DB, table string) []Record {
	t.Helper()
	var rs []Record
	if err := db.Table(table).Order("id").Scan(&rs).Error; err != nil {
		t.Fatalf("outboxtest: read %s: %v", table, err)
	}
	return rs
}

// Count returns the number of rows of table.
func Count(t testing.TB, db *gorm.DB, table string) int64 {
	t.Helper()
	var n int64
	if err := db.Table(table).Count(&n).Error; err != nil {
		t.Fatalf("outboxtest: count %s: %v", table, err)
	}
	return n
}
