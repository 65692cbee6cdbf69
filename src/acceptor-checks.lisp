;;;; A parallel acceptor's initargs checked as it is made: an impossible
;;;; value signals INVALID-ACCEPTOR-CONFIGURATION from MAKE-INSTANCE, not a
;;;; failure at the first request.

(in-package #:hunchentoot-recycling-taskmaster)

(defmethod initialize-instance :after ((acceptor parallel-acceptor) &key)
  (loop for (initarg seconds) in `((:header-timeout ,(acceptor-header-timeout acceptor))
                                   (:keep-alive-timeout ,(acceptor-keep-alive-timeout acceptor))
                                   (:queue-timeout ,(acceptor-queue-timeout acceptor))
                                   (:session-store-timeout ,(acceptor-session-store-timeout acceptor))
                                   (:websocket-ping-interval ,(acceptor-websocket-ping-interval acceptor))
                                   (:websocket-timeout ,(acceptor-websocket-timeout acceptor))
                                   (:websocket-message-timeout ,(acceptor-websocket-message-timeout acceptor)))
        unless (and (realp seconds) (plusp seconds))
          do (error 'invalid-acceptor-configuration
                    :initarg initarg :value seconds
                    :reason "must be a positive number of seconds"))
  ;; Hunchentoot on SBCL has one timeout per socket for both directions, and
  ;; otherwise signals its error at every accept, after the connection is made.
  (unless (eql (hunchentoot:acceptor-read-timeout acceptor) (hunchentoot:acceptor-write-timeout acceptor))
    (error 'invalid-acceptor-configuration
           :initarg :write-timeout :value (hunchentoot:acceptor-write-timeout acceptor)
           :reason (format nil "must equal :READ-TIMEOUT (~S): on SBCL one timeout bounds ~
                                both reads and writes"
                           (hunchentoot:acceptor-read-timeout acceptor))))
  (let ((fd (acceptor-listen-fd acceptor)))
    (unless (or (null fd) (and (integerp fd) (<= 0 fd)))
      (error 'invalid-acceptor-configuration
             :initarg :listen-fd :value fd
             :reason "must be NIL or a descriptor number")))
  (let ((bytes (acceptor-body-buffer-bytes acceptor)))
    (unless (and (integerp bytes) (<= 0 bytes))
      (error 'invalid-acceptor-configuration
             :initarg :body-buffer-bytes :value bytes
             :reason "must be a non-negative integer")))
  (let ((bytes (acceptor-max-body-bytes acceptor)))
    (unless (or (null bytes) (and (integerp bytes) (plusp bytes)))
      (error 'invalid-acceptor-configuration
             :initarg :max-body-bytes :value bytes
             :reason "must be NIL or a positive integer")))
  (let ((bytes (acceptor-max-header-bytes acceptor)))
    (unless (and (integerp bytes) (<= 1024 bytes (* 1024 1024)))
      (error 'invalid-acceptor-configuration
             :initarg :max-header-bytes :value bytes
             :reason "must be an integer from 1024 to 1048576")))
  (loop for (initarg bytes) in `((:max-websocket-message-bytes ,(acceptor-max-websocket-message-bytes acceptor))
                                 (:max-websocket-queue-bytes ,(acceptor-max-websocket-queue-bytes acceptor))
                                 (:http2-max-concurrent-streams ,(acceptor-http2-max-concurrent-streams acceptor)))
        unless (and (integerp bytes) (plusp bytes))
          do (error 'invalid-acceptor-configuration
                    :initarg initarg :value bytes
                    :reason "must be a positive integer"))
  (let ((count (slot-value acceptor 'http2-max-running-streams)))
    (unless (or (null count) (and (integerp count) (plusp count)))
      (error 'invalid-acceptor-configuration
             :initarg :http2-max-running-streams :value count
             :reason "must be NIL or a positive integer")))
  (let ((bytes (acceptor-memory-budget acceptor)))
    (unless (or (null bytes) (and (integerp bytes) (<= (* 1024 1024) bytes)))
      (error 'invalid-acceptor-configuration
             :initarg :memory-budget :value bytes
             :reason "must be NIL or an integer of at least 1048576")))
  (unless (member (acceptor-access-log-format acceptor) '(:hunchentoot :json))
    (error 'invalid-acceptor-configuration
           :initarg :access-log-format :value (acceptor-access-log-format acceptor)
           :reason "must be :HUNCHENTOOT or :JSON"))
  (setf (slot-value acceptor 'compression) (compression-levels (acceptor-compression acceptor)))
  (let ((store (acceptor-session-store acceptor)))
    (unless (typep store '(or null session-store))
      (error 'invalid-acceptor-configuration
             :initarg :session-store :value store
             :reason "must be NIL or a SESSION-STORE"))
    (setf (slot-value acceptor 'sessions) (or store (make-instance 'in-process-sessions)))))

(defun compression-levels (codings)
  "The (CODING . LEVEL) pairs of the :COMPRESSION initarg CODINGS, each
checked, or an INVALID-ACCEPTOR-CONFIGURATION."
  (flet ((refuse ()
           (error 'invalid-acceptor-configuration
                  :initarg :compression :value codings
                  :reason "must be NIL or a list of :ZSTD, :BR and :GZIP, each maybe as (CODING LEVEL): gzip 1 to 9, Brotli 0 to 11, Zstandard 1 to 19")))
    (unless (listp codings) (refuse))
    (let ((levels (mapcar (lambda (coding)
                            (let* ((list (if (listp coding) coding (list coding)))
                                   (name (first list))
                                   (level (second list))
                                   (range (getf '(:gzip (1 9 1) :br (0 11 4) :zstd (1 19 3)) name)))
                              (unless (and range (<= (length list) 2)
                                           (or (null level) (and (integerp level) (<= (first range) level (second range)))))
                                (refuse))
                              (cons name (or level (third range)))))
                          codings)))
      (unless (= (length levels) (length (remove-duplicates levels :key #'car))) (refuse))
      levels)))
