package dialect

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"gorm.io/gorm"
)

// mysqlDialect is MySQL 8.0+ and MariaDB 10.6+ through gorm.io/driver/mysql
// (github.com/go-sql-driver/mysql), tested on MariaDB.
type mysqlDialect struct {
	mariadb bool // the server is MariaDB (mysql_plugin.go)
}

// TimeArg: DATETIME(6) keeps microseconds, and MySQL rounds finer digits
// while MariaDB truncates them; truncated here, a stored time is the same
// on both and never later than the one given. The driver writes it in the
// DSN's loc, in which it also reads DATETIME columns back.
func (mysqlDialect) TimeArg(t time.Time) any { return t.Truncate(time.Microsecond) }

// InsertEvent takes the next sequence of e's aggregate and inserts the
// record: two statements, no read. The upsert hands the new sequence back
// as the statement's insert id (LAST_INSERT_ID(expr) on both paths), and
// its row lock serialises the writers of one aggregate until commit, so
// sequences are gapless and in commit order.
//
// The record's insert is a plain INSERT: ON DUPLICATE KEY and INSERT
// IGNORE act on a clash of any unique key, and a clash of event_id under
// another idempotency key must fail, not vanish. The duplicate-key error
// names the key: a clash of idempotency_key leaves the existing row as it
// is (whatever its state) and reports no insert. In both cases, and when
// the engine refuses a value, only the statement failed, not the
// transaction (InnoDB rolls back a statement, not its transaction, on these
// errors), and the sequence is given back, so that a caller who goes on
// and commits leaves no gap.
func (d mysqlDialect) InsertEvent(ctx context.Context, conn gorm.ConnPool, t Tables, e *Record, now time.Time, _ bool) (bool, error) {
	t = d.Tables(t.Name) // quoted for MySQL, whoever quoted t
	if err := fitsPacket(ctx, conn, e); err != nil {
		return false, err
	}
	res, err := conn.ExecContext(ctx, `INSERT INTO `+t.Sequences+` (aggregate_type, aggregate_id, last_sequence)
VALUES (?, ?, LAST_INSERT_ID(1))
ON DUPLICATE KEY UPDATE last_sequence = LAST_INSERT_ID(last_sequence + 1)`, e.AggregateType, e.AggregateID)
	if err != nil {
		return false, err
	}
	seq, err := res.LastInsertId()
	if err != nil {
		return false, err
	}
	ts := d.TimeArg(now)
	_, err = conn.ExecContext(ctx, `INSERT INTO `+t.Records+` (event_id, event_type, aggregate_type,
	aggregate_id, aggregate_sequence, idempotency_key, payload, headers, delivery_state,
	delivery_attempts, next_attempt_at, occurred_at, created_at, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?)`,
		e.ID, e.Type, e.AggregateType, e.AggregateID, seq, e.Key, e.Payload, e.Headers,
		ts, d.TimeArg(e.OccurredAt), ts, ts)
	switch {
	case err == nil:
		return true, nil
	case duplicateKey(err) == t.Name+"_idempotency_key_key":
		return false, d.releaseSequence(ctx, conn, t, e)
	case duplicateKey(err) != "" || d.RejectsData(err):
		return false, errors.Join(err, d.releaseSequence(ctx, conn, t, e))
	}
	return false, err
}

// bigValue is the size of payload and headers from which InsertEvent
// checks them against the server's max_allowed_packet first (one query):
// a value over it breaks the connection in the middle of the statement,
// and the caller would learn only that the driver lost its connection. No
// server allows less than 1 MiB unless configured to (the defaults are 16
// MiB on MariaDB, 64 MiB on MySQL).
const bigValue = 1 << 20

// errOverPacket is wrapped by the error of an event too big for the
// server's max_allowed_packet; RejectsData reports it.
var errOverPacket = errors.New("over the server's max_allowed_packet")

// fitsPacket reports errOverPacket for an event whose payload and headers,
// with a margin of a kilobyte for the rest of the statement, do not fit
// in the server's max_allowed_packet.
func fitsPacket(ctx context.Context, conn gorm.ConnPool, e *Record) error {
	n := len(e.Payload)
	if e.Headers != nil {
		n += len(*e.Headers)
	}
	if n < bigValue {
		return nil
	}
	var packet int64
	if err := conn.QueryRowContext(ctx, `SELECT @@max_allowed_packet`).Scan(&packet); err != nil {
		return err
	}
	if int64(n)+1024 > packet {
		return fmt.Errorf("payload and headers of %d bytes: %w (%d bytes)", n, errOverPacket, packet)
	}
	return nil
}

// releaseSequence undoes the sequence increment of an event that was not
// inserted. The caller still holds the row lock its own increment took,
// so no other transaction has moved the sequence since.
func (mysqlDialect) releaseSequence(ctx context.Context, conn gorm.ConnPool, t Tables, e *Record) error {
	_, err := conn.ExecContext(ctx, `UPDATE `+t.Sequences+
		` SET last_sequence = last_sequence - 1 WHERE aggregate_type = ? AND aggregate_id = ?`,
		e.AggregateType, e.AggregateID)
	return err
}

// duplicateKey returns the name of the unique key that err, a
// duplicate-key error (1062), reports a clash on, or "" for any other
// error. The server ends the message with "for key '<name>'", the name
// prefixed with the table's since MySQL 8.0.19.
func duplicateKey(err error) string {
	n, msg, ok := mysqlError(err)
	if !ok || n != 1062 {
		return ""
	}
	const marker = "for key '"
	i := strings.LastIndex(msg, marker)
	if i < 0 {
		return ""
	}
	key := strings.TrimSuffix(msg[i+len(marker):], "'")
	return key[strings.LastIndexByte(key, '.')+1:]
}

// RejectsData reports whether err is the engine refusing a value rather
// than failing: the event is then invalid, not the write. Each of these
// errors rolls back the statement only.
func (mysqlDialect) RejectsData(err error) bool {
	n, _, ok := mysqlError(err)
	if !ok {
		return errors.Is(err, errOverPacket)
	}
	switch n {
	case 1048, // a NULL where none may be
		1264, // a number out of range
		1292, // an invalid date or time
		1366, // text the column's character set cannot hold
		1406, // text longer than the column
		3140, // invalid JSON (MySQL)
		3819, // a CHECK constraint (MySQL)
		4025: // a CHECK constraint (MariaDB; its JSON columns check json_valid)
		return true
	}
	return false
}
