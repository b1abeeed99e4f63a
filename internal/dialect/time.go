package dialect

import (
	"errors"
	"fmt"
	"time"
)

// Time scans a timestamp whichever way the driver returns it: a
// time.Time, or the text SQLite stores (ReadTime's column). NULL scans as the zero time; a
// time.Time that is the zero time does not: go-sql-driver returns it for
// MySQL's zero date, '0000-00-00', which is no time (MariaDB's default
// sql_mode stores it).
type Time struct{ Time time.Time }

func (s *Time) Scan(v any) error {
	switch v := v.(type) {
	case time.Time:
		if v.IsZero() {
			return errors.New("outbox: the zero date is not a timestamp")
		}
		s.Time = v
		return nil
	case string:
		return s.parse(v)
	case []byte:
		return s.parse(string(v))
	case nil:
		s.Time = time.Time{}
		return nil
	}
	return fmt.Errorf("outbox: cannot scan %T into a timestamp", v)
}

func (s *Time) parse(v string) error {
	for _, layout := range []string{sqliteTime, time.RFC3339Nano, "2006-01-02 15:04:05.999999999-07:00", "2006-01-02 15:04:05"} {
		if t, err := time.Parse(layout, v); err == nil {
			s.Time = t
			return nil
		}
	}
	return fmt.Errorf("outbox: unrecognised timestamp %q", v)
}
