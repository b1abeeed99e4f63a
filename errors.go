package outbox

import (
	"errors"
	"fmt"
	"sort"
	"strings"
)

var (
	// ErrInvalidEvent is returned (wrapped) when an event cannot be written:
	// a required field is empty, its payload cannot be encoded as JSON, or a
	// raw payload is not valid JSON. The business write it belongs to fails
	// with it and nothing is written.
	ErrInvalidEvent = errors.New("outbox: invalid event")

	// ErrUnidentifiedRows is returned when the plugin cannot learn which
	// rows a write of an emitting model changes, or what happened to them:
	// today, an upsert that may update (clause.OnConflict with DoUpdates
	// or UpdateAll) on SQLite, whose RETURNING does not tell an update
	// from an insert, when it does not name its conflict columns
	// (clause.OnConflict{Columns: ...}) or its rows are maps; on MySQL
	// and MariaDB, an update that sets the primary key to an SQL
	// expression, and an upsert whose rows its primary key cannot tell
	// apart (the model has none, the upsert assigns it, or a unique key's
	// column takes a default or an expression); any write of a kind the
	// engine cannot return rows from (upserts on MySQL 8); and gorm.G's
	// update of a many-to-many association's rows, which GORM runs
	// without a model, when the plugin cannot tell which emitting model
	// has their table. It is returned before the statement runs. Name the
	// conflict columns, write the rows one by one (a parent with
	// Omit(clause.Associations), then its children in a Create of their
	// own), or, when no event is wanted, run the statement through
	// [WithoutEvents] (and [Publish] what is needed).
	ErrUnidentifiedRows = errors.New("outbox: cannot tell which rows the write changes")

	// ErrPluginNotRegistered is returned by [Publish] when the *gorm.DB has no
	// outbox plugin: call db.Use(outbox.Plugin(...)) first.
	ErrPluginNotRegistered = errors.New("outbox: plugin not registered on this *gorm.DB")

	// ErrInvalidOption is returned (wrapped) when configuration is invalid:
	// by constructors and db.Use(outbox.Plugin(...)) for an option out of
	// range, and by registrations ([RegisterEmitter], [Handlers.Handle]) that
	// cannot be accepted. The message names the option or registration.
	ErrInvalidOption = errors.New("outbox: invalid option")

	// ErrPermanent marks a publish failure that retrying cannot help; see
	// [Permanent].
	ErrPermanent = errors.New("outbox: permanent failure")

	// ErrNotAttempted is what a publisher reports, inside a [*PartialError],
	// for a message it did not try, for example because an earlier message
	// of the same aggregate failed in the same batch. The message is put
	// back without counting an attempt and is due again after the
	// dispatcher's poll interval.
	ErrNotAttempted = errors.New("outbox: message not attempted")
)

// Permanent marks err as a failure that retrying cannot help (a malformed
// message, a rejected schema). A batch that fails with a permanent error is
// dead-lettered at once: its rows go to the failed state without further
// retries. errors.Is(Permanent(err), ErrPermanent) and errors.Is(Permanent(err),
// err) both hold. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string { return "permanent: " + e.err.Error() }

func (e *permanentError) Unwrap() []error { return []error{ErrPermanent, e.err} }

// IsPermanent reports whether err, or any error it wraps, was marked with
// [Permanent].
func IsPermanent(err error) bool { return errors.Is(err, ErrPermanent) }

// PartialError reports per-message outcomes of a partly accepted batch. A
// publisher returns it (possibly wrapped) from Publish.
//
// Failed maps the EventID of every message that was not accepted to why.
// Messages of the batch that are absent from Failed were accepted. A failure
// marked with [Permanent] dead-letters that message; [ErrNotAttempted] puts
// it back without counting an attempt; any other error schedules a retry.
//
// A publisher must not accept a message after a failed one of the same
// aggregate in the same batch: report [ErrNotAttempted] for it instead, so
// that per-aggregate order holds. A message accepted all the same is
// logged as an error and settled as not attempted: it is delivered again,
// after the failed one.
type PartialError struct {
	Failed map[string]error
}

// Error summarises the failures, in a stable order.
func (e *PartialError) Error() string {
	ids := make([]string, 0, len(e.Failed))
	for id := range e.Failed {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var b strings.Builder
	fmt.Fprintf(&b, "outbox: %d message(s) not accepted", len(ids))
	for i, id := range ids {
		if i == 3 {
			fmt.Fprintf(&b, "; and %d more", len(ids)-i)
			break
		}
		fmt.Fprintf(&b, "; %s: %v", id, e.Failed[id])
	}
	return b.String()
}
