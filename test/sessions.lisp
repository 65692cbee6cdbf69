;;;; Hunchentoot's session API under a parallel acceptor: in the process, and
;;;; in a session store (here an in-memory one written for the tests, which
;;;; can be made to fail or to stall: the PostgreSQL store's own tests are in
;;;; postgresql-sessions.lisp).  Cookies that are forged, truncated or stale
;;;; never touch the session they name.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite sessions :in all :description "Sessions in the process and in a store.")
(in-suite sessions)

(ht:define-easy-handler (test-session-count :uri "/test/session-count") ()
  (setf (ht:content-type*) "text/plain")
  (princ-to-string (setf (ht:session-value 'count) (1+ (or (ht:session-value 'count) 0)))))

(ht:define-easy-handler (test-session-plain :uri "/test/session-plain") ()
  (setf (ht:content-type*) "text/plain")
  "plain")

(ht:define-easy-handler (test-session-id :uri "/test/session-id") ()
  (setf (ht:content-type*) "text/plain")
  (princ-to-string (ht:session-id (ht:start-session))))

(ht:define-easy-handler (test-session-short :uri "/test/session-short") ()
  (setf (ht:content-type*) "text/plain")
  (setf (ht:session-max-time (ht:start-session)) 1)
  "short")

(ht:define-easy-handler (test-session-redirect :uri "/test/session-redirect") ()
  (setf (ht:session-value 'count) 100)
  (ht:redirect "/test/session-plain"))

(ht:define-easy-handler (test-session-regenerate :uri "/test/session-regenerate") ()
  (ht:regenerate-session-cookie-value (ht:start-session))
  "regenerated")

(ht:define-easy-handler (test-session-unstorable :uri "/test/session-unstorable") ()
  (ht:start-session)
  (setf (ht:session-value 'count) (make-hash-table))
  "not kept")

(ht:define-easy-handler (test-session-remove :uri "/test/session-remove") ()
  (when ht:*session*
    (ht:remove-session ht:*session*))
  "removed")

(ht:define-easy-handler (test-session-gc :uri "/test/session-gc") ()
  (ht:session-gc)
  "collected")

(defun session-cookie (jar)
  "The session cookie's value in the drakma cookie JAR, or NIL."
  (let ((cookie (find "hunchentoot-session" (drakma:cookie-jar-cookies jar)
                      :key #'drakma:cookie-name :test #'string=)))
    (and cookie (drakma:cookie-value cookie))))

(defun get-with-cookie (server path cookie)
  "Status and body of GET PATH sending the session cookie value COOKIE."
  (http-get server path :additional-headers (list (cons "Cookie" (format nil "hunchentoot-session=~A" cookie)))))

(defun count-with-cookie (server cookie)
  "The counter GET /test/session-count answers with the session cookie COOKIE, as an integer."
  (multiple-value-bind (status body) (get-with-cookie server "/test/session-count" cookie)
    (and (eql status 200) (parse-integer body))))

(defun check-cookies-that-name-a-session-wrongly (server)
  "Check on SERVER that a forged, a truncated, a malformed and an expired
session cookie each get a new session or none, and that the real session
they name counts on untouched."
  (let ((jar (make-instance 'drakma:cookie-jar)))
    (http-get server "/test/session-count" :cookie-jar jar)
    (is (equal "2" (nth-value 1 (http-get server "/test/session-count" :cookie-jar jar))))
    (let* ((real (session-cookie jar))
           (id (subseq real 0 (position #\: real))))
      (dolist (wrong (list (format nil "~A:0123456789ABCDEF0123456789ABCDEF" id) ; forged
                           (subseq real 0 (1- (length real))) ; truncated
                           (format nil "~A:" id) id (format nil ":~A" real) "garbage"
                           (format nil "~A~A" id (subseq real (length id)))
                           ;; Bytes no cookie of ours has, which a store must never see.
                           (format nil "~A%00:~A" id (subseq real (1+ (length id))))
                           (format nil "~A:~A%00" id (subseq real (1+ (length id))))
                           (format nil "~A%01%7F:~A" id (subseq real (1+ (length id))))
                           (format nil "%D9%A1~A" real)
                           (format nil "~A:~Az" id (subseq real (1+ (length id))))))
        (unless (string= wrong real)
          (is (eql 1 (count-with-cookie server wrong)) "~S did not start a new session" wrong)))
      (is (equal "3" (nth-value 1 (http-get server "/test/session-count" :cookie-jar jar)))
          "a wrong cookie touched the session it named")
      ;; Expired: a session of 1 s, left unused until its time is over.
      (let ((short (make-instance 'drakma:cookie-jar)))
        (http-get server "/test/session-short" :cookie-jar short)
        (let ((started (get-universal-time)))
          (is (wait-until (lambda () (> (get-universal-time) (+ started 2))) :timeout 5))
          (is (eql 1 (count-with-cookie server (session-cookie short)))
              "an expired session was used")))
      (is (equal "4" (nth-value 1 (http-get server "/test/session-count" :cookie-jar jar)))))))

(test sessions.in-process.wrong-cookies-leave-the-session-alone
  (with-server (server (make-server 'parallel-easy-acceptor))
    (check-cookies-that-name-a-session-wrongly server)))

(test sessions.cookie-value-parsed-as-hunchentoot-makes-it
  (dolist (id (list 1 123456789012345678 1234567890123456789 (1- (expt 2 128)) (expt 10 39)))
    (let ((cookie (format nil "~D:0123456789abcdefABCDEF0123456789" id)))
      ;; Each kind of string a cookie may come as.
      (dolist (string (list cookie (coerce cookie 'simple-base-string)
                            (make-array (length cookie) :element-type 'character :fill-pointer t
                                                        :initial-contents cookie)))
        (is (equal (list id "0123456789abcdefABCDEF0123456789")
                   (multiple-value-list (hrt::parse-session-identifier string)))
            "~A (~S)" string (type-of string)))))
  (dolist (forged (list "12:" ":ab" "1:2:3" "1:xyz" "1 :ab" (format nil "~D:ab" (expt 10 40)) "١:ab"))
    (is (null (hrt::parse-session-identifier forged)) "~S" forged)))

(test sessions.ids-are-128-random-bits
  (with-server (server (make-server 'parallel-easy-acceptor))
    (let ((ids (loop repeat 4 collect (parse-integer (nth-value 1 (http-get server "/test/session-id"))))))
      (is (= 4 (length (remove-duplicates ids))))
      (is (every (lambda (id) (< id (expt 2 128))) ids))
      ;; Four counter values would all be small; four random ids all under 2^64 once in 2^256.
      (is (some (lambda (id) (>= id (expt 2 64))) ids)))))

;;; The session index (sessions/session-index.lisp): it must find what
;;; Hunchentoot's list holds, whichever acceptor changed the list.

(defun session-id-of (cookie)
  (parse-integer cookie :end (position #\: cookie)))

(defun new-session-cookie (server &optional (path "/test/session-count"))
  "The cookie value of a session SERVER starts for GET PATH."
  (let ((jar (make-instance 'drakma:cookie-jar)))
    (http-get server path :cookie-jar jar)
    (session-cookie jar)))

(test sessions.in-process.index-follows-removals-under-any-acceptor
  (with-server (ours (make-server 'parallel-easy-acceptor))
    (with-server (theirs (make-server 'ht:easy-acceptor))
      (let ((by-ours (new-session-cookie ours))
            (by-theirs (new-session-cookie ours))
            (started-by-theirs (new-session-cookie theirs))
            (by-reset (new-session-cookie ours)))
        ;; Sessions enough that the list is long, each seen by the index.
        (loop repeat 20 do (new-session-cookie ours))
        (dolist (cookie (list by-ours by-theirs started-by-theirs by-reset))
          (is (eql 2 (count-with-cookie ours cookie)) "~A was not found" cookie))
        (get-with-cookie ours "/test/session-remove" by-ours)
        (is (eql 1 (count-with-cookie ours by-ours)) "a session removed under ours was found")
        (get-with-cookie theirs "/test/session-remove" by-theirs)
        (is (eql 1 (count-with-cookie ours by-theirs)) "a session removed under Hunchentoot's acceptor was found")
        (is (eql 3 (count-with-cookie ours started-by-theirs)))
        (get-with-cookie theirs "/test/session-remove" started-by-theirs)
        (is (eql 1 (count-with-cookie ours started-by-theirs))
            "a session Hunchentoot's acceptor started and removed was found")
        (is (eql 3 (count-with-cookie ours by-reset)))
        (ht:reset-sessions ours)
        (is (eql 1 (count-with-cookie ours by-reset)) "a session RESET-SESSIONS removed was found")))))

(test sessions.in-process.session-gc-removes-what-expired
  "The GC every *SESSION-GC-FREQUENCY* new sessions, which the index skips
while nothing can have expired, still removes a session whose max time was
shortened after it started."
  (with-server (server (make-server 'parallel-easy-acceptor))
    (let* ((short (new-session-cookie server "/test/session-short"))
           (live (new-session-cookie server))
           (started (get-universal-time)))
      (flet ((held-p (cookie) (assoc (session-id-of cookie) (ht:session-db server))))
        (is (held-p short))
        (is (wait-until (lambda () (> (get-universal-time) (+ started 2))) :timeout 5))
        (loop repeat ht:*session-gc-frequency* do (new-session-cookie server))
        (is (not (held-p short)) "SESSION-GC did not run, or left the expired session")
        (is (held-p live) "SESSION-GC removed a live session")
        (is (eql 2 (count-with-cookie server live)))))))

(ht:define-easy-handler (test-session-start-and-remove :uri "/test/session-start-and-remove") ()
  (setf (ht:content-type*) "text/plain")
  (ht:remove-session (ht:start-session))
  "started and removed")

(defun session-set-cookie-headers (class)
  "The Set-Cookie headers an acceptor of CLASS sends through a session's
life: started, counted, removed, its cookie presented again, removed again;
started and removed in one request; a session of 1 s used after its time.
Each session cookie value written as ID, as ids differ."
  (with-server (server (make-server class))
    (let ((headers '()))
      (flet ((visit (path &optional cookie)
               (let ((header (cdr (assoc :set-cookie
                                         (nth-value 2 (drakma:http-request
                                                       (format nil "http://127.0.0.1:~D~A" (ht:acceptor-port server) path)
                                                       :additional-headers
                                                       (and cookie (list (cons "Cookie" (format nil "hunchentoot-session=~A" cookie))))))))))
                 (push (and header (cl-ppcre:regex-replace "=\\d+:[0-9A-F]+;" header "=ID;")) headers)
                 (and header (cl-ppcre:register-groups-bind (value) ("=(\\d+:[0-9A-F]+);" header) value)))))
        (let ((cookie (visit "/test/session-count")))
          (visit "/test/session-count" cookie)
          (visit "/test/session-remove" cookie)
          (visit "/test/session-plain" cookie)
          (visit "/test/session-remove" cookie))
        (visit "/test/session-start-and-remove")
        (let ((short (visit "/test/session-short"))
              (started (get-universal-time)))
          (wait-until (lambda () (> (get-universal-time) (+ started 2))) :timeout 5)
          (visit "/test/session-plain" short)))
      (nreverse headers))))

(test sessions.in-process.set-cookie-headers-same-as-hunchentoots
  "remove-session's deleted cookie, and every other session cookie, as on
Hunchentoot's own acceptor."
  (let ((theirs (session-set-cookie-headers 'ht:easy-acceptor))
        (ours (session-set-cookie-headers 'parallel-easy-acceptor)))
    (is (equal theirs ours))
    (is (= 3 (count "hunchentoot-session=deleted; Expires=Mon, 01 Jan 1900 00:00:00 GMT; Path=/" ours :test #'equal))
        "~S" ours)))

(defclass session-noting-acceptor (ht:acceptor)
  ((started :initform 0 :accessor sessions-noted))
  (:documentation "A mixin of a user's with its own SESSION-CREATED method."))

(defmethod ht:session-created ((acceptor session-noting-acceptor) session)
  (incf (sessions-noted acceptor))
  (call-next-method))

(defclass parallel-then-session-noting (parallel-easy-acceptor session-noting-acceptor) ())

(test sessions.in-process.session-created-of-a-mixin-after-ours-runs
  (with-server (server (make-server 'parallel-then-session-noting))
    (new-session-cookie server)
    (new-session-cookie server)
    (is (eql 2 (sessions-noted server)))
    (let ((cookie (new-session-cookie server)))
      (is (eql 2 (count-with-cookie server cookie)) "the session was not kept"))))

;;; A store for the tests: sessions in a hash table, which FAILING makes fail
;;; and STALL makes wait (on a semaphore nobody signals, for a deadline to end).

(defclass test-session-store (session-store)
  ((rows :initform (make-hash-table) :reader test-store-rows
         :documentation "Each session id and a plist of its fields, as MAKE-STORED-SESSION takes them,
its values as the text a store keeps.")
   (lock :initform (bt:make-lock "test session store") :reader test-store-lock)
   (failing :initform nil :accessor test-store-failing)
   (stall :initform nil :accessor test-store-stall)
   (never-signalled :initform (bt:make-semaphore) :reader test-store-never-signalled)))

(defun test-store-call (store function)
  (when (test-store-stall store)
    (bt:wait-on-semaphore (test-store-never-signalled store) :timeout 60))
  (when (test-store-failing store)
    (error 'session-store-unavailable :store store :reason "it was told to fail"))
  (bt:with-lock-held ((test-store-lock store))
    (funcall function (test-store-rows store))))

(defun session-from-test-row (row)
  (apply #'hunchentoot-recycling-taskmaster::make-stored-session
         :data (hunchentoot-recycling-taskmaster::session-data-from-text (getf row :data))
         row))

(defmethod find-stored-session ((store test-session-store) id string time)
  (test-store-call store (lambda (rows)
                           (let ((row (gethash id rows)))
                             (when (and row
                                        (equal string (getf row :string))
                                        (<= time (+ (getf row :last-click) (getf row :max-time))))
                               (setf (getf (gethash id rows) :last-click) time)
                               (session-from-test-row (gethash id rows)))))))

(defun test-store-row (session)
  (list :id (ht:session-id session)
        :string (hunchentoot-recycling-taskmaster::session-string session)
        :user-agent (ht:session-user-agent session)
        :remote-addr (ht:session-remote-addr session)
        :start (ht:session-start session)
        :last-click (hunchentoot-recycling-taskmaster::session-last-click session)
        :max-time (ht:session-max-time session)
        :data (hunchentoot-recycling-taskmaster::stored-session-data-text session)))

(defmethod add-stored-session ((store test-session-store) session)
  (test-store-call store (lambda (rows) (setf (gethash (ht:session-id session) rows) (test-store-row session)))))

(defmethod save-stored-session ((store test-session-store) session)
  (test-store-call store (lambda (rows) (setf (gethash (ht:session-id session) rows) (test-store-row session)))))

(defmethod remove-stored-session ((store test-session-store) session)
  (test-store-call store (lambda (rows) (remhash (ht:session-id session) rows))))

(defmethod expired-stored-sessions ((store test-session-store) time)
  (test-store-call store (lambda (rows)
                           (loop for row being the hash-values of rows
                                 when (< (+ (getf row :last-click) (getf row :max-time)) time)
                                   collect (session-from-test-row row)))))

(defun stored-count (store cookie)
  "The counter STORE keeps for the session of COOKIE."
  (let ((row (gethash (parse-integer cookie :junk-allowed t) (test-store-rows store))))
    (and row (cdr (assoc 'count (hunchentoot-recycling-taskmaster::session-data-from-text (getf row :data)))))))

(defun store-server (store &rest initargs)
  (apply #'make-server 'parallel-easy-acceptor :session-store store initargs))

(test sessions.store.wrong-cookies-leave-the-session-alone
  (with-server (server (store-server (make-instance 'test-session-store)))
    (check-cookies-that-name-a-session-wrongly server)))

(test sessions.store.keeps-what-the-handler-changed
  (let ((store (make-instance 'test-session-store))
        (jar (make-instance 'drakma:cookie-jar)))
    (with-server (server (store-server store))
      (http-get server "/test/session-count" :cookie-jar jar)
      (http-get server "/test/session-count" :cookie-jar jar)
      (is (eql 2 (stored-count store (session-cookie jar))))
      (is (eql 200 (http-get server "/test/session-redirect" :cookie-jar jar)))
      (is (eql 100 (stored-count store (session-cookie jar))) "a value set before a redirect was lost")
      ;; A new cookie (as after a login): the old one names the session no more.
      (let ((old (session-cookie jar))
            (started (get-universal-time)))
        ;; The session string changes with the second of the session's start.
        (is (wait-until (lambda () (> (get-universal-time) started)) :timeout 3))
        (http-get server "/test/session-regenerate" :cookie-jar jar)
        (is (string/= old (session-cookie jar)))
        (is (eql 1 (count-with-cookie server old)) "the cookie before the new one still names the session")
        (is (eql 101 (count-with-cookie server (session-cookie jar))))))
    (with-server (server (store-server store))
      (is (equal "102" (nth-value 1 (http-get server "/test/session-count" :cookie-jar jar)))
          "a new acceptor on the same store lost the session"))))

(test sessions.store.unstorable-value-answers-500-and-keeps-the-session
  (let ((store (make-instance 'test-session-store))
        (jar (make-instance 'drakma:cookie-jar)))
    (with-server (server (store-server store))
      (http-get server "/test/session-count" :cookie-jar jar)
      (is (eql 500 (http-get server "/test/session-unstorable" :cookie-jar jar)))
      (is (eql 1 (stored-count store (session-cookie jar))))
      (is (equal "2" (nth-value 1 (http-get server "/test/session-count" :cookie-jar jar)))))))

(test sessions.store.remove-session-and-session-gc-remove-from-the-store
  (let ((store (make-instance 'test-session-store))
        (jar (make-instance 'drakma:cookie-jar))
        (short (make-instance 'drakma:cookie-jar)))
    (with-server (server (store-server store))
      (http-get server "/test/session-count" :cookie-jar jar)
      (http-get server "/test/session-remove" :cookie-jar jar)
      (is (= 0 (hash-table-count (test-store-rows store))))
      (http-get server "/test/session-count" :cookie-jar jar)
      (http-get server "/test/session-short" :cookie-jar short)
      (is (= 2 (hash-table-count (test-store-rows store))))
      (let ((started (get-universal-time)))
        (is (wait-until (lambda () (> (get-universal-time) (+ started 2))) :timeout 5)))
      (http-get server "/test/session-gc")
      (is (= 1 (hash-table-count (test-store-rows store))) "SESSION-GC left an expired session or took a live one")
      (is (eql 1 (stored-count store (session-cookie jar)))))))

(test sessions.store.unavailable-answers-503-only-where-the-session-is-used
  (let ((store (make-instance 'test-session-store))
        (jar (make-instance 'drakma:cookie-jar)))
    (with-thread-leak-check ()
      (with-server (server (store-server store :session-store-timeout 0.5))
        (http-get server "/test/session-count" :cookie-jar jar)
        (dolist (fault '(:failing :stall))
          (if (eq fault :failing)
              (setf (test-store-failing store) t)
              (setf (test-store-stall store) t))
          (let ((started (get-internal-real-time)))
            (multiple-value-bind (status) (http-get server "/test/session-count" :cookie-jar jar)
              (is (eql 503 status) "~S: the request needing its session got ~S" fault status))
            (is (< (/ (- (get-internal-real-time) started) internal-time-units-per-second) 2)
                "~S: the 503 took longer than the timeout" fault))
          (is (eql 200 (http-get server "/test/session-plain" :cookie-jar jar))
              "~S: a request not using its session was refused" fault)
          (setf (test-store-failing store) nil
                (test-store-stall store) nil)
          (is (eql 200 (http-get server "/test/session-count" :cookie-jar jar))))
        (is (eql 3 (stored-count store (session-cookie jar))) "a 503 changed the session")
        (is (wait-until (lambda () (zerop (stats server :in-request-threads)))))))))

(test sessions.store.outage-is-logged-once-when-an-earlier-call-answers-late
  ;; Under load, a call begun before the store stopped answering may report
  ;; its answer after another call's failure began the outage: the outage
  ;; goes on, and is logged begun once and ended once.
  (let* ((store (make-instance 'test-session-store))
         (log (make-string-output-stream))
         (ht:*acceptor* (make-instance 'parallel-easy-acceptor :message-log-destination log))
         (failure (make-condition 'session-store-unavailable :store store :reason "it was told to fail"))
         (before (get-internal-real-time)))
    (flet ((outage-began-at ()
             (cdr (hunchentoot-recycling-taskmaster::session-store-outage-since
                   (hunchentoot-recycling-taskmaster::session-store-outage store))))
           (log-lines (text)
             (count-if (lambda (line) (search text line))
                       (uiop:split-string (get-output-stream-string log) :separator '(#\Newline)))))
      (hunchentoot-recycling-taskmaster::note-session-store-failed store failure (1+ before))
      (is (outage-began-at) "a failure began no outage")
      (hunchentoot-recycling-taskmaster::note-session-store-answered store before)
      (is (outage-began-at) "a call begun before the outage ended it")
      (hunchentoot-recycling-taskmaster::note-session-store-failed store failure (1+ before))
      (is (eql 1 (log-lines "requests that need their session are answered 503")))
      (hunchentoot-recycling-taskmaster::note-session-store-answered store (1+ (outage-began-at)))
      (is (null (outage-began-at)) "a call begun after the outage did not end it")
      (is (eql 1 (log-lines "answers again after"))))))

(defclass request-of-hunchentoot-only (ht:request) ()
  (:documentation "A request class of a user's that does not inherit from PARALLEL-REQUEST."))

(test sessions.store.configuration-is-checked
  (signals invalid-acceptor-configuration
    (make-instance 'parallel-easy-acceptor :session-store "postgres"))
  (signals invalid-acceptor-configuration
    (make-instance 'parallel-easy-acceptor :session-store-timeout 0))
  (let ((acceptor (make-server 'parallel-easy-acceptor :session-store (make-instance 'test-session-store)
                                                       :request-class 'request-of-hunchentoot-only)))
    (signals invalid-acceptor-configuration (ht:start acceptor))
    (is (not (ht:started-p acceptor))))
  (finishes (make-instance 'parallel-easy-acceptor :session-store (make-instance 'test-session-store))))
