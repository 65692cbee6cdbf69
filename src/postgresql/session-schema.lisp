;;;; The tables of the PostgreSQL session store, made by the store itself:
;;;; each migration has a version, applied once, in order, in one
;;;; transaction under an advisory lock (processes starting together wait
;;;; for each other), and recorded in hunchentoot_session_schema.  A new
;;;; schema is a new migration at the end of the list, never an edit of one
;;;; already released.
;;;;
;;;; hunchentoot_sessions, one row per session:
;;;;   id              the session id, 128 random bits, in decimal
;;;;   session_string  the cookie's secret part, after the id and colon
;;;;   user_agent      the User-Agent of the client that started it
;;;;   remote_addr     that client's address (HUNCHENTOOT:REAL-REMOTE-ADDR)
;;;;   started_at      universal time it started (or was given a new cookie)
;;;;   last_click      universal time it was last used
;;;;   max_time        seconds it lives unused (HUNCHENTOOT:SESSION-MAX-TIME)
;;;;   data            its values, as readable text (sessions/session-values.lisp)
;;;; A session has expired once last_click + max_time is past; the index on
;;;; that sum serves the expiry test of every lookup and SESSION-GC.
;;;;
;;;; hunchentoot_channel_messages, one row per message of the channel bus
;;;; too long for a notification (event-bus.lisp), kept a minute.

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *session-schema-migrations*
  '((1
     "CREATE TABLE hunchentoot_sessions (
        id text PRIMARY KEY,
        session_string text NOT NULL,
        user_agent text,
        remote_addr text,
        started_at bigint NOT NULL,
        last_click bigint NOT NULL,
        max_time integer NOT NULL,
        data text NOT NULL)"
     "CREATE INDEX hunchentoot_sessions_expiry ON hunchentoot_sessions ((last_click + max_time))")
    (2
     "CREATE TABLE hunchentoot_channel_messages (
        id bigserial PRIMARY KEY,
        payload text NOT NULL,
        stored_at timestamptz NOT NULL DEFAULT now())"))
  "Each version of the schema and the statements that make it from the one before.")

(defconstant +session-schema-lock+ 731849206
  "The advisory lock key under which the schema is brought up to date.")

(defun session-schema-version (connection)
  "The version of the session schema in CONNECTION's database, 0 for none."
  (cl-postgres:exec-query connection "CREATE TABLE IF NOT EXISTS hunchentoot_session_schema (
                                        version integer PRIMARY KEY,
                                        applied_at timestamptz NOT NULL DEFAULT now())")
  (caar (cl-postgres:exec-query connection "SELECT coalesce(max(version), 0) FROM hunchentoot_session_schema"
                                'cl-postgres:list-row-reader)))

(defun migrate-session-schema (connection)
  "Apply the migrations CONNECTION's database lacks.  The server's notices
(a table that already exists) are not the user's to read."
  (handler-bind ((cl-postgres:postgresql-warning #'muffle-warning))
    (migrate-session-schema-quietly connection)))

(defun migrate-session-schema-quietly (connection)
  (cl-postgres:exec-query connection "BEGIN")
  (let ((committed nil))
    (unwind-protect
         (progn
           (cl-postgres:exec-query connection (format nil "SELECT pg_advisory_xact_lock(~D)" +session-schema-lock+))
           (let ((version (session-schema-version connection)))
             (loop for (migration . statements) in *session-schema-migrations*
                   when (> migration version)
                     do (dolist (statement statements)
                          (cl-postgres:exec-query connection statement))
                        (cl-postgres:exec-query connection (format nil "INSERT INTO hunchentoot_session_schema (version) ~
                                                                        VALUES (~D)" migration))))
           (cl-postgres:exec-query connection "COMMIT")
           (setf committed t))
      (unless committed
        (ignore-errors (cl-postgres:exec-query connection "ROLLBACK"))))))
