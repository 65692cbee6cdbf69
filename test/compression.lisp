;;;; Compressed replies: the coding chosen from Accept-Encoding as RFC 9110
;;;; weighs it, nginx's rules for what is coded, the body decoding to the
;;;; identity reply (decoded by gzip, brotli and zstd, the command-line
;;;; tools), HEAD, entity tags and 304s of static files, precompressed
;;;; siblings.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite compression :in all :description "Replies coded as the client accepts: gzip, Brotli, Zstandard.")
(in-suite compression)

(test content-coding.accept-encoding-weighed-as-rfc-9110-says
  (loop for (accept-encoding codings expected)
          in '(("gzip" (:zstd :br :gzip) :gzip)
               ("GZIP" (:gzip) :gzip)
               ("x-gzip" (:gzip) :gzip)
               ("gzip;q=0" (:gzip) nil)
               ("gzip; q=0.000" (:gzip) nil)
               ("gzip;q=0.001" (:gzip) :gzip)
               ("gzip;q=1.000" (:gzip) :gzip)
               ("gzip;q=2" (:gzip) nil)
               ("gzip;q=0.5x" (:gzip) nil)
               ("gzip;level=1" (:gzip) nil)
               ("br;q=0.5, gzip" (:zstd :br :gzip) :br)
               ("gzip, br, zstd" (:gzip :br :zstd) :gzip)
               ("*" (:zstd :br :gzip) :zstd)
               ("*;q=0, gzip" (:zstd :gzip) :gzip)
               ("gzip;q=0, *" (:gzip :br) :br)
               ("identity" (:gzip) nil)
               ("" (:gzip) nil)
               (" , ,gzip ,, " (:gzip) :gzip)
               (nil (:gzip) nil))
        do (is (eq expected (hunchentoot-recycling-taskmaster::accepted-coding accept-encoding codings))
               "~S of ~S: ~S" accept-encoding codings expected))
  (let ((long (format nil "~{~A~^, ~}" (loop repeat 10000 collect "compress;q=0.5"))))
    (is (null (hunchentoot-recycling-taskmaster::accepted-coding long '(:gzip))))))

(test content-coding.types-and-entity-tags
  (let ((types '("text/*" "application/json" "image/svg+xml")))
    (loop for (type expected) in '(("text/html; charset=utf-8" t) ("TEXT/CSS" t) ("application/json" t)
                                   ("application/jsonx" nil) ("image/png" nil) ("textual/plain" nil)
                                   ("image/svg+xml;charset=utf-8" t) (nil nil) ("" nil))
          do (is (eq expected (and (hunchentoot-recycling-taskmaster::codable-type-p type types) t)) "~S" type)))
  (is (equal "\"abc-gzip\"" (hunchentoot-recycling-taskmaster::coded-entity-tag "\"abc\"" :gzip)))
  (is (equal "W/\"abc-br\"" (hunchentoot-recycling-taskmaster::coded-entity-tag "W/\"abc\"" :br))))

(ht:define-easy-handler (test-lorem :uri "/test/lorem") ((kb :parameter-type 'integer :init-form 10) type encoding)
  (setf (ht:content-type*) (or type "text/html")
        (ht:header-out :etag) "\"lorem\"")
  (when encoding
    (setf (ht:header-out :content-encoding) encoding))
  (lorem-text kb))

(defun lorem-text (kb)
  (with-output-to-string (out)
    (loop for line from 0 below (* kb 16)
          do (format out "~4,'0D Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do.~%" line))))

(defun raw-reply (server path &key (method "GET") headers)
  "Status, head (a string) and body (octets) of METHOD PATH sent to SERVER
with HEADERS (strings \"Name: value\"), on a connection of its own."
  (let ((socket (connect server)))
    (unwind-protect
         (let ((stream (usocket:socket-stream socket)))
           (write-sequence (flex:string-to-octets
                            (apply #'crlf-lines (format nil "~A ~A HTTP/1.1" method path) "Host: x" "Connection: close"
                                   (append headers '(""))))
                           stream)
           (finish-output stream)
           (let ((octets (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)))
             (loop for octet = (read-byte stream nil) while octet do (vector-push-extend octet octets))
             (let* ((end (search #(13 10 13 10) octets))
                    (head (flex:octets-to-string octets :end end :external-format :latin-1)))
               (values (parse-integer head :start 9 :end 12) head
                       (coerce (subseq octets (+ end 4)) '(simple-array (unsigned-byte 8) (*)))))))
      (usocket:socket-close socket))))

(defun head-field (head name)
  "The value of the header NAME in the reply HEAD, or NIL."
  (multiple-value-bind (match groups) (cl-ppcre:scan-to-strings (format nil "(?im)^~A:\\s*(.*?)\\r?$" name) head)
    (and match (aref groups 0))))

(defun decoded (octets coding)
  "OCTETS decoded by the command-line tool of CODING, as a string."
  (let ((file (format nil "/tmp/hrt-coded-~D-~D" (sb-posix:getpid) (random 1000000))))
    (unwind-protect
         (progn (with-open-file (out file :direction :output :element-type '(unsigned-byte 8) :if-exists :supersede)
                  (write-sequence octets out))
                (uiop:run-program (ecase coding
                                    (:gzip (list "gzip" "-dc" file))
                                    (:br (list "brotli" "-dc" file))
                                    (:zstd (list "zstd" "-dcq" file)))
                                  :output :string))
      (ignore-errors (delete-file file)))))

(defun coding-server (&rest initargs)
  (apply #'make-server 'parallel-easy-acceptor :compression '(:zstd :br :gzip) initargs))

(test compression.each-coding-chosen-alone-decodes-to-the-identity-reply
  (with-thread-leak-check ()
    (with-server (server (coding-server))
      (let ((identity (lorem-text 10)))
        (dolist (coding '(:gzip :br :zstd))
          (multiple-value-bind (status head body)
              (raw-reply server "/test/lorem?kb=10" :headers (list (format nil "Accept-Encoding: ~(~A~)" coding)))
            (is (eql 200 status))
            (is (equal (string-downcase (symbol-name coding)) (head-field head "Content-Encoding")) "~A" head)
            (is (equal "Accept-Encoding" (head-field head "Vary")))
            (is (equal (length body) (parse-integer (head-field head "Content-Length"))))
            (is (< (length body) (* 0.4 (length identity))) "~A: ~D octets of ~D" coding (length body) (length identity))
            (is (equal (format nil "\"lorem-~(~A~)\"" coding) (head-field head "ETag")))
            (is (string= identity (decoded body coding)) "~A decodes to the identity reply" coding)))))))

(test compression.what-is-not-coded
  (with-thread-leak-check ()
    (with-server (server (coding-server))
      (flet ((coding-of (path &rest headers)
               (multiple-value-bind (status head) (raw-reply server path :headers headers)
                 (declare (ignore status))
                 (values (head-field head "Content-Encoding") (head-field head "Vary")))))
        (multiple-value-bind (coding vary) (coding-of "/test/lorem" "Accept-Encoding: gzip;q=0, br;q=0, zstd;q=0")
          (is (null coding) "q=0 refuses")
          (is (equal "Accept-Encoding" vary) "a reply that could have been coded varies"))
        (multiple-value-bind (coding vary) (coding-of "/test/lorem")
          (is (null coding) "no Accept-Encoding, no coding")
          (is (equal "Accept-Encoding" vary)))
        (multiple-value-bind (coding vary) (coding-of "/test/yo" "Accept-Encoding: gzip")
          (is (null coding) "a 4-byte reply")
          (is (null vary) "too short to be coded: no Vary"))
        (is (null (coding-of "/test/lorem?type=image/png" "Accept-Encoding: gzip")) "image/png")
        (is (equal "identity-of-its-own" (coding-of "/test/lorem?encoding=identity-of-its-own" "Accept-Encoding: gzip"))
            "a reply with a Content-Encoding of its own is not coded again")
        (is (null (coding-of "/test/error" "Accept-Encoding: gzip")) "a 500")
        (is (equal "gzip" (coding-of "/test/lorem?type=application/json;%20charset=utf-8" "Accept-Encoding: gzip"))
            "JSON is")))))

(test compression.head-has-get-headers-and-no-body
  (with-thread-leak-check ()
    (with-server (server (coding-server))
      (multiple-value-bind (get-status get-head get-body)
          (raw-reply server "/test/lorem" :headers '("Accept-Encoding: br"))
        (multiple-value-bind (status head body)
            (raw-reply server "/test/lorem" :method "HEAD" :headers '("Accept-Encoding: br"))
          (is (eql get-status status))
          (dolist (name '("Content-Encoding" "Content-Length" "ETag" "Vary" "Content-Type"))
            (is (equal (head-field get-head name) (head-field head name)) "~A" name))
          (is (plusp (length get-body)))
          (is (zerop (length body)) "HEAD has no body"))))))

(defmacro with-static-folder ((var) &body body)
  `(let ((,var (make-scratch-folder)))
     (unwind-protect (progn ,@body)
       (uiop:delete-directory-tree (uiop:ensure-directory-pathname ,var) :validate t))))

(defun write-text-file (path text)
  (with-open-file (out path :direction :output :if-exists :supersede)
    (write-string text out)))

(test compression.static-file-coded-with-its-own-entity-tag
  (with-thread-leak-check ()
    (with-static-folder (folder)
      (write-text-file (concatenate 'string folder "index.html") (lorem-text 4))
      (with-server (server (coding-server :document-root folder))
        (multiple-value-bind (status head) (raw-reply server "/index.html")
          (is (eql 200 status))
          (let ((identity-tag (head-field head "ETag")))
            (is (equal "bytes" (head-field head "Accept-Ranges")))
            (is (equal "Accept-Encoding" (head-field head "Vary")))
            (multiple-value-bind (status head body) (raw-reply server "/index.html" :headers '("Accept-Encoding: gzip"))
              (is (eql 200 status))
              (is (equal "gzip" (head-field head "Content-Encoding")))
              (let ((coded-tag (head-field head "ETag")))
                (is (and coded-tag (string/= identity-tag coded-tag)) "~A and ~A" identity-tag coded-tag)
                (is (string= (lorem-text 4) (decoded body :gzip)))
                (is (eql 304 (raw-reply server "/index.html"
                                        :headers (list "Accept-Encoding: gzip" (format nil "If-None-Match: ~A" coded-tag))))
                    "the coded version's tag gets 304")
                (is (eql 200 (raw-reply server "/index.html"
                                        :headers (list "Accept-Encoding: gzip" (format nil "If-None-Match: ~A" identity-tag))))
                    "the identity version's tag does not")
                (multiple-value-bind (status head) (raw-reply server "/index.html"
                                                              :headers '("Accept-Encoding: gzip" "Range: bytes=0-9"))
                  (is (eql 200 status) "a range of a coded file is the whole coded file")
                  (is (equal "gzip" (head-field head "Content-Encoding"))))
                (multiple-value-bind (status head body) (raw-reply server "/index.html" :method "HEAD"
                                                                                        :headers '("Accept-Encoding: gzip"))
                  (is (eql 200 status))
                  (is (equal coded-tag (head-field head "ETag")))
                  (is (zerop (length body))))))))))))

(test compression.precompressed-siblings-by-preference
  (with-thread-leak-check ()
    (with-static-folder (folder)
      (let ((file (concatenate 'string folder "notes.txt")))
        (write-text-file file (lorem-text 2))
        (uiop:run-program (list "gzip" "-k" file))
        (uiop:run-program (list "brotli" "-k" file))
        ;; No :COMPRESSION: every sibling, zstd, br, gzip first, and
        ;; nothing coded on the way.
        (with-server (server (make-server 'parallel-easy-acceptor :document-root folder))
          (loop for (accept expected) in '(("gzip" "gzip") ("gzip, br" "br") ("zstd" nil) ("zstd, gzip" "gzip"))
                do (multiple-value-bind (status head body)
                       (raw-reply server "/notes.txt" :headers (list (format nil "Accept-Encoding: ~A" accept)))
                     (is (eql 200 status))
                     (is (equal expected (head-field head "Content-Encoding")) "~A gets ~A" accept expected)
                     (is (equal "Accept-Encoding" (head-field head "Vary")))
                     (is (string= (lorem-text 2) (if expected
                                                     (decoded body (intern (string-upcase expected) :keyword))
                                                     (flex:octets-to-string body :external-format :latin-1)))))))
        ;; An acceptor that prefers gzip gets the .gz though br is offered.
        (with-server (server (make-server 'parallel-easy-acceptor :document-root folder :compression '(:gzip :br)))
          (multiple-value-bind (status head) (raw-reply server "/notes.txt" :headers '("Accept-Encoding: br, gzip"))
            (is (eql 200 status))
            (is (equal "gzip" (head-field head "Content-Encoding")))))))))

(test compression.configuration-refused
  (dolist (compression '(:gzip (:deflate) ((:gzip 0)) ((:gzip 10)) ((:br 12)) ((:zstd 20)) (:gzip :gzip) ((:gzip 1 2))))
    (signals invalid-acceptor-configuration
      (make-server 'parallel-easy-acceptor :compression compression)))
  (is (equal '((:zstd . 3) (:br . 4) (:gzip . 6))
             (hunchentoot-recycling-taskmaster::acceptor-compression
              (make-server 'parallel-easy-acceptor :compression '(:zstd :br (:gzip 6)))))))

(test compression.off-by-default
  (with-thread-leak-check ()
    (with-server (server (make-server 'parallel-easy-acceptor))
      (multiple-value-bind (status head) (raw-reply server "/test/lorem" :headers '("Accept-Encoding: gzip, br, zstd"))
        (is (eql 200 status))
        (is (null (head-field head "Content-Encoding")))
        (is (null (head-field head "Vary")))))))

(ht:define-easy-handler (test-lorem-stream :uri "/test/lorem-stream") ((kb :parameter-type 'integer :init-form 10))
  (setf (ht:content-type*) "text/html")
  (let ((stream (flex:make-flexi-stream (ht:send-headers) :external-format :latin-1))
        (text (lorem-text kb)))
    ;; Half, a FORCE-OUTPUT, then the rest.
    (write-string text stream :end (floor (length text) 2))
    (force-output stream)
    (write-string text stream :start (floor (length text) 2))
    nil))

(test compression.streamed-reply-coded-as-written
  (with-thread-leak-check ()
    (with-server (server (coding-server))
      (multiple-value-bind (status head body)
          (raw-reply server "/test/lorem-stream" :headers '("Accept-Encoding: gzip"))
        (is (eql 200 status))
        (is (equal "gzip" (head-field head "Content-Encoding")))
        (is (equal "chunked" (head-field head "Transfer-Encoding")))
        (is (equal "Accept-Encoding" (head-field head "Vary")))
        (let ((coded (dechunked body)))
          (is (< (length coded) (* 0.4 (length (lorem-text 10)))))
          (is (string= (lorem-text 10) (decoded coded :gzip)))))
      (multiple-value-bind (status head body) (raw-reply server "/test/lorem-stream" :headers '("Accept-Encoding: br"))
        (is (eql 200 status))
        (is (null (head-field head "Content-Encoding")) "only gzip codes a stream")
        (is (string= (lorem-text 10) (flex:octets-to-string (dechunked body) :external-format :latin-1))))
      ;; The connection goes on after a coded stream.
      (is (eql 200 (http-get server "/test/yo"))))))

(defun dechunked (octets)
  "The data of the chunked body OCTETS, its chunks joined, as far as they
have arrived."
  (let ((data (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)))
    (loop with position = 0
          for line-end = (search #(13 10) octets :start2 position)
          for size = (and line-end
                          (parse-integer (flex:octets-to-string octets :start position :end line-end
                                                                       :external-format :latin-1)
                                         :radix 16 :junk-allowed t))
          while (and size (plusp size))
          do (loop for index from (+ line-end 2) below (min (length octets) (+ line-end 2 size))
                   do (vector-push-extend (aref octets index) data))
             (setf position (+ line-end 2 size 2))
          while (< position (length octets)))
    (coerce data '(simple-array (unsigned-byte 8) (*)))))

(defvar *stream-may-end* nil
  "A semaphore the test below signals once its client has decoded what the
handler flushed.")

(ht:define-easy-handler (test-flushed-stream :uri "/test/flushed-stream") ()
  (setf (ht:content-type*) "text/plain")
  (let ((stream (flex:make-flexi-stream (ht:send-headers) :external-format :latin-1)))
    (write-string (lorem-text 1) stream)
    (force-output stream)
    (sb-thread:wait-on-semaphore *stream-may-end* :timeout 10)
    (write-string "the end" stream)
    nil))

(test compression.streamed-reply-sent-whole-at-each-force-output
  ;; What was written before a FORCE-OUTPUT decodes whole while the handler
  ;; still waits: a sync flush, not left in the compressor.
  (with-thread-leak-check ()
    (with-server (server (coding-server))
      ;; Global, not bound: the handler runs in a worker.
      (setf *stream-may-end* (sb-thread:make-semaphore))
      (let ((socket (connect server)))
        (unwind-protect
             (let ((stream (usocket:socket-stream socket))
                   (octets (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer t)))
               (write-sequence (flex:string-to-octets (crlf-lines "GET /test/flushed-stream HTTP/1.1" "Host: x"
                                                                  "Accept-Encoding: gzip" "Connection: close" ""))
                               stream)
               (finish-output stream)
               (flet ((partly-decoded ()
                        (let ((end (search #(13 10 13 10) octets)))
                          (and end
                               (let ((coded (dechunked (coerce (subseq octets (+ end 4)) '(simple-array (unsigned-byte 8) (*))))))
                                 (and (plusp (length coded))
                                      (let ((file (format nil "/tmp/hrt-partial-~D" (sb-posix:getpid))))
                                        (with-open-file (out file :direction :output :element-type '(unsigned-byte 8)
                                                                  :if-exists :supersede)
                                          (write-sequence coded out))
                                        (prog1 (uiop:run-program (list "gzip" "-dc" file) :output :string
                                                                                          :error-output nil :ignore-error-status t)
                                          (delete-file file)))))))))
                 (is (wait-until (lambda ()
                                   (loop while (usocket:wait-for-input socket :timeout 0.05 :ready-only t)
                                         do (let ((octet (read-byte stream nil)))
                                              (if octet (vector-push-extend octet octets) (return))))
                                   (equal (lorem-text 1) (partly-decoded)))
                                 :timeout 10)
                     "what was flushed decodes whole while the handler waits")
                 (sb-thread:signal-semaphore *stream-may-end*)
                 (loop for octet = (read-byte stream nil) while octet do (vector-push-extend octet octets))
                 (is (equal (concatenate 'string (lorem-text 1) "the end") (partly-decoded)))))
          (sb-thread:signal-semaphore *stream-may-end*)
          (usocket:socket-close socket))))))
